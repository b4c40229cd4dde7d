"""LoRA adapters: PEFT files loaded and checked against the base model (`adapter`), their
weights stacked in device slots (`slots`), and which adapters a step holds (`manager`)."""
