"""Training: a tiny end-to-end run, falling loss, exact resume."""
from __future__ import annotations

import json

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, HeadCheckpoint, run_to_end
from gumiho_core.train import train
from gumiho_core.train_data import generate_dataset, load_conversations
from tiny import hf_greedy, random_prompts, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, eos=False)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    generate_dataset(target, folder, random_prompts(24, seed=3), max_new_tokens=32, batch_size=8,
                     shard_size=12, mask="all", progress=False)
    return folder


def quiet(_):
    pass


def test_data_folder_holds_the_targets_own_answers(target, data):
    conversations = load_conversations(data)
    assert len(conversations) == 24
    prompts = random_prompts(24, seed=3)
    for c, prompt in zip(conversations, prompts):
        ids = c["input_ids"].tolist()
        answer = hf_greedy(target, prompt, 32)
        # Prompt + the target's own greedy answer; an answer that runs to the batch's last
        # step loses its final token (features are caught while generating, see train_data.py).
        assert ids[: len(prompt)] == prompt
        kept = ids[len(prompt):]
        assert kept == answer[: len(kept)] and len(kept) >= len(answer) - 1
        with torch.no_grad():  # the features are what an unpadded pass over the conversation gives
            feats = target.base(input_ids=c["input_ids"][None]).last_hidden_state[0]
        torch.testing.assert_close(c["features"], feats, atol=2e-3, rtol=2e-3)  # stored as float16


def test_tiny_run_gives_heads_that_load_and_decode_losslessly(target, data, tmp_path):
    result = train(target, data, tmp_path / "run", epochs=2, batch_size=4, lr=3e-3, warmup_steps=2,
                   draft_vocab_size=64, log=quiet)
    heads = HeadCheckpoint.load(result["heads"], target)
    assert heads.config.draft_vocab_size == len(heads.draft_vocab) <= 64
    engine = Engine(target, heads)
    for prompt in random_prompts(4, seed=50):
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=20))
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=20, speculative=False))
        assert spec.token_ids == plain.token_ids
    meta = json.loads((tmp_path / "run" / "heads" / "heads.json").read_text())
    assert meta["training"]["epochs"] == 2 and len(meta["training"]["history"]) == 2


def test_loss_falls(target, data, tmp_path):
    # A random target's next-token distributions are nearly flat, so most of the
    # cross-entropy is its entropy and cannot be learned away; the rest must go.
    result = train(target, data, tmp_path / "run", epochs=6, batch_size=4, lr=3e-3, warmup_steps=2,
                   draft_vocab_size=96, log=quiet)
    losses = [h["train_loss"] for h in result["history"]]
    assert losses[-1] < 0.92 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]  # validation too


def test_resume_continues_where_it_stopped(target, data, tmp_path):
    args = dict(batch_size=4, lr=3e-3, warmup_steps=2, draft_vocab_size=64, log=quiet)
    straight = train(target, data, tmp_path / "a", epochs=3, **args)

    def killed_in_epoch_2(line):  # the run dies before epoch 2 is saved
        if line.startswith("epoch 2/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(target, data, tmp_path / "b", epochs=3, **{**args, "log": killed_in_epoch_2})
    resumed = train(target, data, tmp_path / "b", epochs=3, **args)  # picks up after epoch 1
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    for a, b in zip(straight["history"], resumed["history"]):
        assert a["step"] == b["step"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    wa = HeadCheckpoint.load(straight["heads"]).state_dict()
    wb = HeadCheckpoint.load(resumed["heads"]).state_dict()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=1e-5)
    # Going on for more epochs than planned works, and says that the schedule changes.
    lines = []
    longer = train(target, data, tmp_path / "a", epochs=4, **{**args, "log": lines.append})
    assert [h["epoch"] for h in longer["history"]] == [1, 2, 3, 4]
    assert any("planned for 3 epochs and now runs 4" in line for line in lines)


def test_bf16_mixed_precision_trains_and_keeps_float32_weights(target, data, tmp_path, monkeypatch):
    import gumiho_core.train as train_module

    monkeypatch.setattr(train_module, "cpu_has_native_bf16", lambda: False)  # as on an AVX2-only CPU
    lines = []
    result = train(target, data, tmp_path / "run", epochs=3, batch_size=4, lr=3e-3, warmup_steps=2,
                   draft_vocab_size=96, mixed_precision="bf16", log=lines.append)
    if not torch.cuda.is_available():
        assert any(line.startswith("warning: this CPU has no native bf16") for line in lines)
    losses = [h["train_loss"] for h in result["history"]]
    assert losses[-1] < losses[0]
    heads = HeadCheckpoint.load(result["heads"])
    assert all(p.dtype == torch.float32 for p in heads.parameters())


def test_init_starts_a_new_run_from_trained_heads(target, data, tmp_path):
    args = dict(batch_size=4, lr=3e-3, warmup_steps=2, log=quiet)
    first = train(target, data, tmp_path / "a", epochs=3, draft_vocab_size=64, **args)
    # Without a draft_vocab_size the heads keep the vocabulary they were trained with.
    warm = train(target, data, tmp_path / "b", epochs=1, init=first["heads"], **args)
    start = HeadCheckpoint.load(first["heads"])
    heads = HeadCheckpoint.load(warm["heads"])
    assert torch.equal(heads.draft_vocab, start.draft_vocab)
    assert warm["history"][0]["loss"] < first["history"][0]["loss"]  # it did not start from scratch
    # The starting heads were validated first, on the same held-out conversations: what
    # the first run's last epoch measured, since they are those heads.
    assert warm["start"]["loss"] == pytest.approx(first["history"][-1]["loss"], rel=1e-5)
    assert first["start"] is None
    meta = json.loads((tmp_path / "b" / "heads" / "heads.json").read_text())
    assert meta["training"]["init"] == first["heads"]


def test_init_with_a_draft_vocab_size_repicks_the_vocabulary_only(target, data, tmp_path):
    first = train(target, data, tmp_path / "a", epochs=1, batch_size=4, draft_vocab_size=48, log=quiet)
    start = HeadCheckpoint.load(first["heads"])
    # lr 0: what changes is the vocabulary alone, the learned weights stay as they were.
    warm = train(target, data, tmp_path / "b", epochs=1, batch_size=4, lr=0.0, draft_vocab_size=80,
                 init=first["heads"], log=quiet)
    heads = HeadCheckpoint.load(warm["heads"])
    assert heads.config.draft_vocab_size == len(heads.draft_vocab) == 80 > len(start.draft_vocab)
    assert set(start.draft_vocab.tolist()) < set(heads.draft_vocab.tolist())  # the most frequent stay in
    for name, value in start.state_dict().items():
        if name != "draft_vocab":
            torch.testing.assert_close(heads.state_dict()[name], value, msg=name)


def test_several_data_folders_train_as_one_set(target, data, tmp_path):
    more = tmp_path / "more"
    generate_dataset(target, more, random_prompts(8, seed=9), max_new_tokens=16, batch_size=8, shard_size=8,
                     mask="all", progress=False)
    train(target, [data, more], tmp_path / "run", epochs=1, batch_size=4, draft_vocab_size=64, log=quiet)
    meta = json.loads((tmp_path / "run" / "heads" / "heads.json").read_text())["training"]
    assert meta["data"] == [str(data), str(more)]
    assert meta["conversations"] == 24 + 8 - 1  # one held out for validation (5 %, at least one)


def test_init_with_heads_of_another_target_is_refused(data, tmp_path):
    from gumiho_core import GumihoError, new_heads

    other = tiny_target(seed=1, eos=False, vocab=128)
    HeadCheckpoint.save(new_heads(other), tmp_path / "other")
    with pytest.raises(GumihoError, match="do not match"):
        train(tiny_target(seed=0, eos=False), data, tmp_path / "run", epochs=1, init=tmp_path / "other", log=quiet)


def test_data_resumes_only_with_the_same_prompts(target, tmp_path):
    from gumiho_core.errors import GumihoError

    folder = tmp_path / "data"
    prompts = random_prompts(8, seed=3)
    generate_dataset(target, folder, prompts[:4], max_new_tokens=8, batch_size=4, shard_size=4, progress=False)
    # The same prompts, extended: the first four are kept, only the new four are answered.
    manifest = generate_dataset(target, folder, prompts, max_new_tokens=8, batch_size=4, shard_size=4,
                                progress=False)
    assert [s["prompts"] for s in manifest["shards"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Other prompts (another --seed) into the same folder would silently mix two prompt sets.
    with pytest.raises(GumihoError, match="made from other prompts"):
        generate_dataset(target, folder, random_prompts(12, seed=4), max_new_tokens=8, batch_size=4,
                         shard_size=4, progress=False)
    assert len(load_conversations(folder)) == 8  # nothing lost or added by the refused run


def test_token_weight_scales_the_cross_entropy_term_only(target, data):
    from gumiho_core.train import DraftTrainer, collate, new_trainable_heads

    heads = new_trainable_heads(target, draft_vocab=list(range(64)), seed=0)
    batch = collate(load_conversations(data)[:4], 512)

    def loss(weight):
        trainer = DraftTrainer(heads, target.embed_tokens.weight, target.lm_head.weight, token_weight=weight)
        with torch.no_grad():
            return float(trainer(batch)["loss"])

    features_only, one, three = loss(0.0), loss(1.0), loss(3.0)
    assert one > features_only  # the cross-entropy term is positive and really added
    assert three - features_only == pytest.approx(3 * (one - features_only), rel=1e-4)


def test_token_weight_is_recorded_with_the_heads(target, data, tmp_path):
    train(target, data, tmp_path / "run", epochs=1, batch_size=4, draft_vocab_size=64, token_weight=0.5, log=quiet)
    meta = json.loads((tmp_path / "run" / "heads" / "heads.json").read_text())["training"]
    assert meta["token_weight"] == 0.5
