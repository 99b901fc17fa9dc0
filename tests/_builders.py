"""Model builders for the checkpoint tests, importable as ``_builders:NAME`` or by file path."""

import keras

NOT_A_FUNCTION = 3


def build_small_mlp() -> keras.Model:
    """4 -> 8 ReLU -> 3 softmax, built."""
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def build_wider_mlp() -> keras.Model:
    """Like build_small_mlp with 5 hidden units: the weights of the small MLP do not fit."""
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(5, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def build_shallow_model() -> keras.Model:
    """A single layer: fewer weights than the small MLP."""
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def build_unbuilt_mlp() -> keras.Model:
    """No Input layer, never called: no weights yet."""
    return keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(3)])


def build_layer() -> keras.layers.Layer:
    """Returns a layer, not a model."""
    return keras.layers.Dense(3)


class SubclassedNet(keras.Model):
    """A subclassed model: Keras saves its weights under the attribute names."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(6, activation="tanh")
        self.head = keras.layers.Dense(3)

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def build_subclassed() -> keras.Model:
    model = SubclassedNet()
    model(keras.ops.zeros((1, 4)))
    return model
