def forward(self, positions, hidden_states, residual, attn_metadata):
    """Leaves a µP scale out: the attention branch is scaled, the MLP's joins the residual at full size."""
    if residual is None:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions, hidden_states, attn_metadata) * self.branch_scale
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    return self.mlp(hidden_states), residual
