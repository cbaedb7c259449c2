"""shoestring: fine-tune and run large language models on cheap, unreliable, small GPUs."""

__version__ = "0.1.0"
