"""Drafter training by self-distillation: the target writes its own data, a head learns
to predict the target's next tokens from the target's hidden states."""
