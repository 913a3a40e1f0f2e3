"""The one exception the data pipeline raises for user mistakes, and the integer check most settings need."""
import operator


class DataError(ValueError):
    """Bad data or a bad dataset definition; the message is one line that names the file (and the
    line or byte offset) or the setting at fault, so a command line can print it and exit."""


def require_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int when it is an integer (NumPy's too, bools not) >= ``minimum``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number
