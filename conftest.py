"""Root conftest: the project's pytest plugin lives in properties.plugin."""
