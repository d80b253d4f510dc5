"""Pure builders: an `InferencePool` in, child manifests (plain dicts) out, one file per kind.

`children.build_children` assembles them; nothing here talks to the API server.
"""
