# Structured outputs as vLLM's offline example shapes them (choice, regex, a JSON schema from a
# pydantic model, an EBNF grammar), with the import line and the model changed; needs the extra:
# pip install -e ".[structured]".
import json
import sys
from enum import Enum

from pydantic import BaseModel

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


def main():
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "nanovllm:demo")
    cases = {
        "choice": (StructuredOutputsParams(choice=["Positive", "Negative"]), "result = "),
        "regex": (StructuredOutputsParams(regex=r"[a-z]{3,10}@[a-z]{3,10}\.com"), "email = "),
        "json": (StructuredOutputsParams(json=CarDescription.model_json_schema(),
                                         disable_any_whitespace=True),
                 "car = "),
        "grammar": (StructuredOutputsParams(grammar='root ::= "SELECT " column " FROM " table\n'
                                                    'column ::= "name" | "id" | "price"\n'
                                                    'table ::= "users" | "orders"'), "query = "),
    }
    for name, (constraint, prompt) in cases.items():
        params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=constraint)
        output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        print(f"{name}: {output.text!r} (finish_reason={output.finish_reason!r})")
        if name == "json":
            print("parsed:", CarDescription.model_validate(json.loads(output.text)))


if __name__ == "__main__":
    main()
