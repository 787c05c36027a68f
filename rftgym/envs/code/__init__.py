"""Code environment (after O1-CODER): tasks, a Test Case Generator, and sandboxed execution."""
