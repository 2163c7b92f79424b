"""The spine's own machinery: the device context, the micro-batcher, the deferred completions.

`import services` first: it installs the finder of the compiled request path
(`services.compiled`), which covers modules of this package too.
"""

import services  # noqa: F401
