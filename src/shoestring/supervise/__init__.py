"""`shoestring run`: launch a job (through torchrun for several processes), restart it."""
