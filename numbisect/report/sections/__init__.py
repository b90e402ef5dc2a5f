"""Text lines for one report section each (conditions, decode, recurrent state, routing,
sparse-attention selection), read from the report alone."""
