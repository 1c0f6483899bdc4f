"""The decoder every architecture runs: the registry of architectures, the config read from a checkpoint, the layer plan and the PyTorch model."""
