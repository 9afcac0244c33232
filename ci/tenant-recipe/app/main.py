"""The app's Python part: the pip package the recipe installed."""
import kiln_hello

print("python: " + kiln_hello.MSG)
