#!/bin/sh
# The app's check (the recipe's last step): each thing the recipe installed answers.
set -e
for p in kiln-hello kiln-hello-data kiln-hello-doc; do
  echo "apt $p: $(cat "/usr/share/$p/hello.txt")"
done
python3 main.py
node main.js
