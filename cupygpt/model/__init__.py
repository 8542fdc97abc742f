"""GPT-2 over the backend interface: its shape, flat layouts, initialisation, the Stage
(forward and backward of a part of the model) and AdamW."""
