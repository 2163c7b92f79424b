"""The middlewares, each a gRPC service defined once, and the pipeline that calls them.

Importing the package puts the finder of the compiled request path first on `sys.meta_path`
(`services.compiled`: a module runs from its Cython build only when the build was made from
its current source), before any module it covers can be imported.
"""

from services.compiled import install as _install_compiled

_install_compiled()
