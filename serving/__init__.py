"""llmkube data plane: the torch engine, the OpenAI API and the Ray Serve apps."""
