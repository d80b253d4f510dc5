"""The OpenAI surface: request schemas, error bodies, response bodies and their streaming."""
