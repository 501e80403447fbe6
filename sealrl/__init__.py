"""sealrl: RL post-training with a sealed, versioned experience record."""
__version__ = "0.1.0"
