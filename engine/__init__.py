"""Engine: the parts a user touches. For now the scheduler simulation and its CLI."""
