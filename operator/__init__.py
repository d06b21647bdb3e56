"""llmkube control plane: the kopf operator. Never imports torch."""
