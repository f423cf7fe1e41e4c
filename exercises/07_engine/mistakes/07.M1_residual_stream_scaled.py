def forward(self, positions, hidden_states, residual, attn_metadata):
    """Scales the residual stream (branch plus residual) instead of the branch alone."""
    if residual is None:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    residual = residual * self.branch_scale
    return self.mlp(hidden_states) * self.branch_scale, residual
