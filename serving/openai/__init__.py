"""The OpenAI-compatible API over any ``EngineClient``: ``app.build_app`` is the entry point."""
