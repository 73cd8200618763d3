"""The model package's error types, in a module of their own so that the config, the layer plan
and the vision config can all raise them without importing one another."""


class ConfigError(ValueError):
  """A model configuration whose fields contradict each other; the message names them."""
