"""Code generation from the Python sources of truth (Jinja templates in templates/)."""
