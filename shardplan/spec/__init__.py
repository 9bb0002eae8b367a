"""What the user asks for: pydantic models of the job file, sizes, counts and errors."""
