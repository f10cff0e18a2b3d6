"""An OpenAI-compatible HTTP front (`enginewright serve`) over the Triton router models.

It runs as its own process, never inside Triton, so unlike the rest of `serving` it uses FastAPI.
"""
