#!/bin/bash
# The oracle: what a correct agent does.
echo "hello harbor" > /app/answer.txt
