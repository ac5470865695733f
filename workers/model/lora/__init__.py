"""How a pass puts several adapters' LoRA updates on one batch's rows: in row blocks, stacked,
and on a mixture of experts' stacked weights."""
