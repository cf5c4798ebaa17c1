"""spheroid: decentralised training and serving of BlockTrain byte-level language models."""

__version__ = "0.1.0"
