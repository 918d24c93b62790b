"""deltarl: lossless sparse weight deltas for RL post-training across regions."""
__version__ = "0.1.0"
