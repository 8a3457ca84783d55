"""The built-in prompt generator for self-distillation data (`train-data --num-prompts N`).

The heads only learn what the target says in the data, so the prompts should cover what a
chat user asks: writing, role-play, reasoning puzzles, math, coding, extraction from a text,
science and humanities explanations, advice, summaries, facts and follow-up turns. Each
category is a handful of templates over lists of fillers; the combinations give thousands
of distinct requests. Deterministic for a seed, so a resumed `train-data` run sees the same
list in the same order. (The benchmark question files are never used; see train_data.py.)
"""
from __future__ import annotations

import random

TOPICS = [
    "the ocean", "volcanoes", "honey bees", "the Roman Empire", "black holes", "coffee", "chess",
    "climate change", "the human heart", "electric cars", "the Moon", "photosynthesis", "jazz",
    "the printing press", "rainforests", "sleep", "vaccines", "the internet", "pyramids",
    "recycling", "earthquakes", "penguins", "solar energy", "the French Revolution", "bread baking",
    "friendship", "time management", "learning a language", "gardening", "running a marathon",
    "the stock market", "artificial intelligence", "public libraries", "bicycles", "rivers",
    "dinosaurs", "the immune system", "music practice", "city parks", "the Silk Road",
    "glaciers", "video games", "tea ceremonies", "mountain hiking", "robots", "owls",
    "the water cycle", "ancient Egypt", "remote work", "healthy breakfasts", "the Olympic Games",
    "smartphones", "wind turbines", "coral reefs", "the Renaissance", "street food", "origami",
    "space stations", "the Great Wall of China", "bees and pollination", "deserts", "tornadoes",
    "the Industrial Revolution", "podcasts", "minimalism", "board games", "photography",
    "yoga", "the Amazon river", "electric guitars", "submarines", "wolves", "mushrooms",
    "the Vikings", "public transport", "3D printing", "the moon landing", "cheese making",
    "rock climbing", "the periodic table", "sign language", "lighthouses", "hot air balloons",
    "the Arctic", "bamboo", "comic books", "chocolate", "trains", "dolphins", "ancient Greece",
    "the Mars rovers", "tidal energy", "camping", "kindness", "budget travel", "old castles",
]
PLACES = ["Hawaii", "Kyoto", "Iceland", "Morocco", "Peru", "Norway", "a small Italian village", "New York City",
          "the Scottish Highlands", "Cape Town", "Vietnam", "the Swiss Alps", "Lisbon", "Patagonia", "Istanbul"]
AUDIENCES = ["a child", "a ten-year-old", "a teenager", "a busy adult", "a beginner", "an expert",
             "my grandmother", "a new employee", "a college student", "someone who has never heard of it"]
FORMS = ["a short poem", "a haiku", "a short story", "a limerick", "a diary entry", "a speech",
         "a product description", "a letter", "a dialogue between two friends", "a news headline and lede",
         "a blog post", "a song chorus", "a motivational message", "a short essay", "a tweet",
         "a restaurant review", "a fairy tale", "a persuasive paragraph", "a travel guide entry",
         "an advertisement", "a thank-you note", "a movie plot summary", "a riddle", "a bedtime story"]
TONES = ["funny", "serious", "inspiring", "calm", "dramatic", "friendly", "formal", "playful",
         "mysterious", "warm", "sarcastic", "optimistic"]
CONSTRAINTS = ["", "", " Keep it under 100 words.", " Use simple words.", " Include a surprising twist.",
               " End with a question.", " Use at least one metaphor.", " Make it rhyme.",
               " Write it in the first person.", " Give it a title."]
EMAILS = ["ask your manager for a day off", "invite colleagues to a team lunch", "complain politely about a late delivery",
          "thank a teacher", "ask a professor for a recommendation letter", "follow up after a job interview",
          "apologise for missing a meeting", "propose a new project to your team", "ask a neighbour to keep the noise down",
          "welcome a new member to the book club", "request feedback on a report", "decline an invitation kindly"]
PERSONAS = ["a pirate captain", "a medieval knight", "a friendly robot", "a detective in 1920s London",
            "a wise old wizard", "a tour guide in Rome", "a professional chef", "a personal fitness coach",
            "an astronaut on the International Space Station", "a travel agent", "a librarian", "a grumpy cat",
            "Sherlock Holmes", "a kindergarten teacher", "a sports commentator", "a museum curator",
            "a startup founder", "a marine biologist", "a time traveller from the year 3000", "a dragon"]
PERSONA_TASKS = ["Introduce yourself and describe a typical day.", "Give me advice about {topic}.",
                 "Tell me about {topic} in your own style.", "What is your greatest adventure?",
                 "Answer my question: why should I care about {topic}?", "Describe your favourite place.",
                 "Convince me to try {activity}.", "What would you say to someone who is having a bad day?"]
ACTIVITIES = ["cooking", "public speaking", "drawing", "saving money", "writing", "focusing", "swimming",
              "meditation", "learning the piano", "journaling", "painting", "playing chess", "knitting", "dancing"]
DILEMMAS = ["working from home", "living in a big city", "owning a dog", "studying abroad", "waking up early",
            "social media", "electric scooters", "homeschooling", "a four-day work week", "online shopping",
            "nuclear power", "self-driving cars", "renting instead of buying a house", "learning to code"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the nth Fibonacci number",
    "counts the words in a sentence", "removes duplicates from a list while keeping order",
    "finds the largest element of a list", "converts Celsius to Fahrenheit", "merges two sorted lists",
    "checks whether a string is a palindrome", "flattens a nested list", "computes a factorial",
    "returns the most common character in a string", "sorts a list of dictionaries by a key",
    "parses a date string like 2024-03-01", "implements binary search", "reads a CSV file and sums a column",
    "validates an email address with a regular expression", "computes the greatest common divisor",
    "transposes a matrix", "implements a simple stack class", "counts vowels in a string",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "computes the sum of the digits of a number", "finds all pairs in a list that sum to a target",
    "implements a queue using two stacks", "converts a Roman numeral to an integer",
    "rotates a list by k positions", "finds the longest word in a sentence", "computes the mean and median of a list",
    "capitalises the first letter of every word", "checks whether a year is a leap year",
    "implements bubble sort", "finds the intersection of two lists", "counts how often each word appears",
    "generates all subsets of a set", "checks whether brackets in a string are balanced",
    "converts a number to binary", "finds the missing number in a list from 1 to n",
    "implements a linked list with insert and delete",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "C++", "Java", "Rust", "Go", "SQL", "Bash", "TypeScript"]
SNIPPETS = [
    "def add(a, b):\n    return a - b",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)",
    "def average(xs):\n    return sum(xs) / len(xs)",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "function greet(name) {\n  return 'Hello, ' + name;\n}",
    "def find(xs, t):\n    for i in range(len(xs)):\n        if xs[i] == t:\n            return i\n    return -1",
    "while True:\n    line = input()\n    if line == 'quit':\n        break",
    "SELECT name, COUNT(*) FROM orders GROUP BY name;",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)",
    "numbers = [3, 1, 2]\nnumbers.sort()\nprint(numbers[0])",
]
NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
         "Maya", "Noah", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
ITEMS = [("apples", 3), ("pencils", 2), ("stickers", 1), ("books", 12), ("cupcakes", 4), ("marbles", 1),
         ("tickets", 15), ("notebooks", 5), ("oranges", 2), ("toy cars", 7), ("cookies", 2), ("plants", 9),
         ("candles", 6), ("shirts", 20), ("eggs", 1), ("bottles of juice", 3)]
SCIENCE = [
    "how vaccines train the immune system", "why the sky is blue", "how a rainbow forms", "what DNA does",
    "how batteries store energy", "what causes the seasons", "how airplanes stay in the air", "what an atom is made of",
    "how plants make food from sunlight", "why ice floats on water", "how the heart pumps blood",
    "what a black hole is", "how earthquakes happen", "what gravity is", "how a computer stores data",
    "why we need sleep", "how magnets work", "what causes tides", "how sound travels", "what inflation is",
    "how a refrigerator keeps food cold", "what natural selection means", "how the internet sends data",
    "what a chemical reaction is", "how solar panels make electricity", "why leaves change colour in autumn",
    "what supply and demand means", "how antibiotics work", "what the speed of light means",
    "how clouds form", "what entropy is in simple terms", "how GPS finds your location",
]
HUMANITIES = [
    "the causes of the First World War", "the importance of the Magna Carta", "what democracy means",
    "the role of the Silk Road in trade", "why the Renaissance started in Italy", "the ideas of Confucius",
    "the effects of the Industrial Revolution on cities", "what makes a good leader", "the history of writing",
    "the role of museums in society", "the difference between weather and climate policy", "why people tell stories",
    "the impact of the printing press on education", "how money was invented", "the meaning of freedom of speech",
    "the fall of the Roman Empire", "what philosophers mean by ethics", "the influence of the Beatles on music",
    "why learning history matters", "how cities grew over time", "the role of art in ancient Egypt",
]
PASSAGES = [
    "The city council met on Tuesday to discuss a new bike lane on Main Street. Supporters said it would "
    "make cycling safer and cut traffic, while some shop owners worried about losing parking spaces. "
    "The council agreed to run a six-month trial before making a final decision.",
    "Researchers found that people who took a short walk after lunch reported feeling more focused in the "
    "afternoon. The study followed 200 office workers for eight weeks. The effect was strongest for those "
    "who walked outdoors rather than indoors.",
    "Our team finished the quarter with sales up 12 percent, mostly thanks to the new online store. "
    "Shipping delays hurt customer reviews in March, but a new warehouse partner fixed the problem in April. "
    "Next quarter we plan to expand into two new regions.",
    "The library will close for renovations from June to August. During that time, books can be returned "
    "at the community center, and the children's reading club will meet in the park on Saturday mornings. "
    "The renovated library will have a larger study area and a new computer lab.",
    "A small bakery in the village started using solar panels last year. Its energy bills fell by almost half, "
    "and the owner used the savings to hire another baker. Other shops on the street are now considering "
    "doing the same.",
    "The school football team won the regional final 3-1 on Saturday. The team had lost its first three games "
    "of the season, but a new coach changed the training plan. Fans celebrated in the town square until late.",
    "A new study suggests that reading to children for twenty minutes a day improves their vocabulary. "
    "The researchers compared 500 families over two years. Children who were read to every day knew "
    "about 30 percent more words by age five.",
    "The museum opened a new exhibition about ancient Egypt this week. It includes 120 objects, among them "
    "jewellery, tools and a painted coffin. Tickets are free for students, and guided tours run every hour.",
]
COMPANIES = ["Northwind", "BluePeak", "Sunfield", "Orbitek", "Greenleaf", "Redstone", "Nimbus", "Silverline"]
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Toronto", "Mumbai", "Sydney", "Cairo", "Madrid", "Seoul"]
FOLLOW_UPS = ["Can you make it shorter?", "Now explain it in simpler words.", "Give me one more example.",
              "Can you turn that into a list of three bullet points?", "What is the most important point?",
              "Rewrite it in a more formal tone.", "Why is that?", "Thanks! Can you add a short conclusion?",
              "Can you say that again as a short poem?", "What would be a good title for this?",
              "Now rewrite it for a five-year-old.", "Are there any downsides?", "Can you give me a real-world example?",
              "Translate the first sentence into French.", "Summarise your answer in one sentence."]


def builtin_prompts(n: int, seed: int = 0) -> list[list[str]]:
    """`n` distinct conversations, each a list of user turns, cycling through the categories.

    A category whose combinations run out (after many tries) gives way to the others.
    """
    rng = random.Random(seed)
    seen, out, misses = set(), [], 0
    while len(out) < n and misses < 1000 * len(MAKERS):
        turns = MAKERS[(len(out) + misses) % len(MAKERS)](rng)
        if tuple(turns) in seen:
            misses += 1
            continue
        seen.add(tuple(turns))
        out.append(turns)
    return out


def _writing(rng) -> list[str]:
    return [rng.choice([
        f"Write {rng.choice(FORMS)} about {rng.choice(TOPICS)}. Make it {rng.choice(TONES)}.{rng.choice(CONSTRAINTS)}",
        f"Write a travel blog post about a trip to {rng.choice(PLACES)}, with the sights and the food.{rng.choice(CONSTRAINTS)}",
        f"Write an email to {rng.choice(EMAILS)}. Keep it short and polite.",
        f"Describe a character who loves {rng.choice(TOPICS)}, in a {rng.choice(TONES)} way.",
        f"Write the opening paragraph of a novel set in {rng.choice(PLACES)}.",
        f"Give me five creative names for a shop that sells things related to {rng.choice(TOPICS)}.",
    ])]


def _roleplay(rng) -> list[str]:
    task = rng.choice(PERSONA_TASKS).format(topic=rng.choice(TOPICS), activity=rng.choice(ACTIVITIES))
    return [rng.choice([f"Pretend you are {rng.choice(PERSONAS)}. {task}",
                        f"Act as {rng.choice(PERSONAS)}. {task}",
                        f"You are {rng.choice(PERSONAS)}. Stay in character. {task}"])]


def _reasoning(rng) -> list[str]:
    a, b, c = rng.sample(NAMES, 3)
    x, y = rng.randint(2, 15), rng.randint(2, 15)
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    return [rng.choice([
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
        f"{a} is {x} years older than {b}. In {y} years, {b} will be {x + y + 10}. How old is {a} now?",
        f"What comes next in the sequence {start}, {start + step}, {start + 2 * step}, {start + 3 * step}? Why?",
        f"If all {rng.choice(['cats', 'birds', 'robots', 'teachers'])} in a town are {rng.choice(['friendly', 'tall', 'quiet'])}, "
        f"and {a} lives in that town and is one of them, what can we say about {a}?",
        f"In a race, {a} finished before {b} but after {c}. Who won, and who came last?",
        f"I have {x} coins in my pocket, all nickels and dimes, worth {x * 5 + y * 5} cents. How many of each do I have?",
        f"A farmer has {x} chickens and {y} cows. How many legs are there in total? Think step by step.",
        f"Which is heavier: a kilogram of {rng.choice(['feathers', 'cotton', 'paper'])} or a kilogram of "
        f"{rng.choice(['iron', 'stones', 'gold'])}? Explain.",
    ])]


def _math(rng) -> list[str]:
    a, b = rng.sample(NAMES, 2)
    (item, price), x, y = rng.choice(ITEMS), rng.randint(3, 40), rng.randint(2, 9)
    p, q = rng.randint(2, 12), rng.randint(1, 30)
    return [rng.choice([
        f"{a} has {x} {item} and buys {y} more packs of {y} each. How many {item} does {a} have now?",
        f"{item.capitalize()} cost ${price} each. {a} buys {x} and pays with a ${price * x + y * 5} bill. How much change does {a} get?",
        f"{a} and {b} share {x * y} {item} so that {a} gets {y - 1} times as many as {b}. Is that possible with whole numbers? Explain.",
        f"A train travels {x * 10} km in {y} hours. What is its average speed? Then, how far would it go in {y + 2} hours?",
        f"{a} saves ${x} every week. How many weeks until {a} can buy a bike that costs ${x * y + price}?",
        f"What is {x} times {y}, plus {price * 7}? Show your work step by step.",
        f"Solve for x: {p}x + {q} = {p * y + q}.",
        f"A rectangle is {x} cm long and {y} cm wide. What are its area and perimeter?",
        f"What is {y * 10} percent of {x * 20}?",
        f"A shop gives a {rng.choice([10, 15, 20, 25, 30])}% discount on a ${x * 5} jacket. What is the new price?",
        f"If you roll two dice, what is the probability that the sum is {rng.randint(2, 12)}?",
        f"{a} reads {y} pages a day. The book has {x * y + q} pages. How many days does {a} need to finish it?",
        f"Find the average of {x}, {y}, {p} and {q}.",
    ])]


def _coding(rng) -> list[str]:
    lang, task = rng.choice(LANGUAGES), rng.choice(CODE_TASKS)
    snippet = rng.choice(SNIPPETS)
    return [rng.choice([
        f"Write a {lang} function that {task}.",
        f"How do I write code in {lang} that {task}? Please explain the steps.",
        f"Write a {lang} function that {task}, with a short example of using it.",
        f"Write a Python program that {task}, and add comments.",
        f"Explain what this code does:\n\n{snippet}",
        f"Is there a bug in this code? If so, fix it.\n\n{snippet}",
        f"What is the time complexity of a function that {task}? Explain.",
        f"What is the difference between a list and a {rng.choice(['tuple', 'set', 'dictionary'])} in Python?",
    ])]


def _extraction(rng) -> list[str]:
    passage = rng.choice(PASSAGES)
    n1, n2 = rng.sample(COMPANIES, 2)
    c1, c2 = rng.sample(CITIES, 2)
    v1, v2 = rng.randint(10, 900), rng.randint(10, 900)
    report = (f"{n1}, based in {c1}, reported revenue of ${v1} million this year. "
              f"{n2}, headquartered in {c2}, reported ${v2} million.")
    return [rng.choice([
        f"Extract the company names, cities and revenues from this text as JSON:\n\n{report}",
        f"Which company earned more, and by how much?\n\n{report}",
        f"List every number in this text and say what it refers to:\n\n{passage}",
        f"Find all the places and dates mentioned in this text:\n\n{passage}",
        f"Is the tone of this text positive, negative or neutral? Explain.\n\n{passage}",
        f"Write three questions that this text answers:\n\n{passage}",
    ])]


def _stem(rng) -> list[str]:
    concept = rng.choice(SCIENCE)
    return [rng.choice([
        f"Explain {concept}.", f"Explain {concept} to {rng.choice(AUDIENCES)}.",
        f"Can you describe {concept}, with an everyday example?",
        f"What are common misconceptions about {concept.split(' ', 1)[1] if ' ' in concept else concept}?",
    ])]


def _humanities(rng) -> list[str]:
    subject = rng.choice(HUMANITIES)
    return [rng.choice([
        f"Discuss {subject}.", f"Write a short essay on {subject}.",
        f"What should a student know about {subject}?",
        f"Give three arguments for and against {rng.choice(DILEMMAS)}.",
    ])]


def _chat(rng) -> list[str]:
    topic = rng.choice(TOPICS)
    return [rng.choice([
        f"Hi! I'm curious about {topic}. What should I know?",
        f"Can you give me some tips about {topic}?",
        f"What do you think is the most interesting thing about {topic}?",
        f"I have to talk about {topic} tomorrow and I'm nervous. Any advice?",
        f"Explain {topic} to {rng.choice(AUDIENCES)}.",
        f"What are the pros and cons of {rng.choice(DILEMMAS)}?",
        f"How can I get better at {rng.choice(ACTIVITIES)}?",
        f"Plan a three-day trip to {rng.choice(PLACES)} for me.",
        f"Suggest a weekly schedule for learning {rng.choice(ACTIVITIES)}.",
        f"My friend is sad because {rng.choice(['she lost her job', 'his dog is sick', 'they moved away', 'she failed an exam'])}. What can I say?",
    ])]


def _summary(rng) -> list[str]:
    passage = rng.choice(PASSAGES)
    ask = rng.choice(["Summarize this in one sentence:", "Summarize the following text:",
                      "What are the key points of this text?", "Write a title for this text and then summarize it:",
                      "Rewrite this text for a children's newspaper:", "Turn this text into three bullet points:"])
    return [f"{ask}\n\n{passage}"]


def _factual(rng) -> list[str]:
    topic = rng.choice(TOPICS)
    return [rng.choice([
        f"What is {topic}?", f"Tell me three facts about {topic}.", f"What is the history of {topic}?",
        f"Why is {topic} important?", f"How does {topic} work?",
        f"What is the capital of {rng.choice(['France', 'Japan', 'Brazil', 'Canada', 'Kenya', 'Australia', 'Egypt', 'India', 'Mexico', 'Italy'])}?",
        f"Who invented the {rng.choice(['telephone', 'light bulb', 'airplane', 'printing press', 'World Wide Web', 'steam engine'])}?",
        f"Compare {topic} and {rng.choice(TOPICS)}.",
    ])]


def _multi_turn(rng) -> list[str]:
    first = rng.choice([_chat, _writing, _factual, _coding, _stem, _roleplay])(rng)
    return first + [rng.choice(FOLLOW_UPS)]


MAKERS = [_writing, _roleplay, _reasoning, _math, _coding, _extraction, _stem, _humanities,
          _chat, _summary, _factual, _multi_turn]
