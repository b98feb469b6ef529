"""Warning classes of pipekit-train (tests turn them into errors)."""


class PipekitTrainWarning(UserWarning):
    """A warning from pipekit-train: something worked, but probably not as the user meant."""
