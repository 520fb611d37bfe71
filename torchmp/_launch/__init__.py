"""How a worker starts: every launch of torchmp, in one place."""
