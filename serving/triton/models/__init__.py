"""Triton python-backend models (``llm``, ``router``) and their pure helpers.

``llm.py`` and ``router.py`` are copied into the model repository as ``<version>/model.py``; they import
their helpers (``serving.triton.models.*``) from the project installed in the venv the stub runs in.
"""
