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
