"""First-party molt plugins. Each subpackage is registered through molt-sdk's own ``molt``
entry points, exactly as a third-party distribution would register its plugins."""
