"""gumiho-chat's application: the Gradio chat, its SQLite sessions and the OpenAI route."""
