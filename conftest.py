"""Root conftest: the project's pytest plugin lives in properties.plugin.

Registered here (the root conftest is the one place pytest_plugins may be
declared) so that every run from the repository root, the command line's
included, gets the property options (--impl, --backend, --repeats, ...).
"""

pytest_plugins = ["properties.plugin"]
