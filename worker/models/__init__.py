"""Model definitions (the Llama family) and the loader that turns a ModelSource into weights."""
