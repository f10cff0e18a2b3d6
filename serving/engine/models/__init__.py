"""The model families of the `torch` engine, one file each, and the registry that maps a Hugging Face
architecture name to its family (`registry.ARCHITECTURES`)."""
