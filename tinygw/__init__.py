"""tinygw: a small LLM API gateway that steps around providers it knows are down."""

__version__ = "0.1.0"
