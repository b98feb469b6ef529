"""The converter functions the Keras package re-exports (`register_converter`, `convert_model`,
`registered_converters`): the built-in converters (every factory of the zoo, in all twelve directions among
Equinox, Keras, Lightning and Flax) are `pipekit_train.backends`'."""

from __future__ import annotations

from pipekit_train.backends import convert_model, register_converter, registered_converters

__all__ = ["convert_model", "register_converter", "registered_converters"]
