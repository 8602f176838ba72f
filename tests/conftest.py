"""Session-wide test setup."""

# ansible-core replaces `sys.intern` with a patch object when its module_utils are imported (the roles tests do),
# and torch._dynamo, imported lazily on first use, then fails to register its polyfill for sys.intern. Importing
# dynamo first, while sys.intern is still the builtin, lets both live in one pytest process.
import torch._dynamo  # noqa: F401
