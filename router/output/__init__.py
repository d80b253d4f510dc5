"""A generation's output as OpenAI's chat shapes need it: text pieces split into content,
reasoning and tool calls (`Piece`, `parse_pieces`)."""
