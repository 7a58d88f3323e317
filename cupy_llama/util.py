"""Small helpers every layer uses."""
import numbers


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b, in integers."""
    return -(-a // b)


def as_flag(value) -> bool | None:
    """A yes/no setting as a bool: Python or NumPy bools, and the integers 0 and 1 (Python
    or NumPy); None for anything else. SamplingParams and EngineConfig take flags this way."""
    is_numpy_bool = type(value).__name__ in ("bool_", "bool")  # np.bool_ is not Integral
    if (isinstance(value, numbers.Integral) or is_numpy_bool) and value in (0, 1):
        return bool(value)
    return None


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun, the noun plural (noun + "s", or `plural`) unless the count is
    1: "1 token", "2 tokens", "1 reply", "0 replies"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def json_type(value) -> str:
    """What a JSON value is, in JSON's words ("an object", "null"), for messages about
    JSON input that is of the wrong kind."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
