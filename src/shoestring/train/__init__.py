"""The LoRA fine-tuning loop, its data pipeline, model loading and exports."""
