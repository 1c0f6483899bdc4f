"""The choices the model layer takes at load, named where the command line lists them without
loading PyTorch."""

LOAD_FORMATS = ("auto", "dummy")  # "dummy": random weights from config.json alone
QUANTIZATIONS = ("int8", "int4")  # weight-only, at load (model/quant.py)
