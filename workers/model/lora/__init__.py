"""How a pass puts several adapters' LoRA updates on one batch's rows: in row blocks, stacked,
grouped (persistent stacks and grouped matmuls), and on a mixture of experts' stacked
weights."""
