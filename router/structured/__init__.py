"""Structured outputs and forced tool calls as one llguidance grammar per request, checked and
validated off the event loop (`GrammarCompiler`, `GrammarRequest`)."""
