"""Twenty pydantic models for `client.chat.completions.parse(response_format=...)`: nested
objects, arrays, enums, bounded numbers and optional fields, each with a prompt that suits it.
Arrays and strings are bounded so that a small model's constrained answer ends within
`max_tokens`."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Short = Annotated[str, Field(max_length=16)]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: Short
    country: Short


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: Short
    city: Short
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Employee(BaseModel):
    person: Person
    address: Address


class Shopping(BaseModel):
    items: list[Short] = Field(min_length=1, max_length=3)


class Paint(BaseModel):
    color: Color
    litres: float = Field(gt=0, le=10)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Book(BaseModel):
    title: Short
    author: Short
    year: int = Field(ge=1400, le=2030)
    subtitle: Short | None = None


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Line(BaseModel):
    start: Point
    end: Point


class Weather(BaseModel):
    city: Short
    celsius: int = Field(ge=-60, le=60)
    sky: Literal["sunny", "cloudy", "rainy"]


class Todo(BaseModel):
    task: Short
    done: bool


class TodoList(BaseModel):
    todos: list[Todo] = Field(min_length=1, max_length=2)


class Product(BaseModel):
    name: Short
    price: float = Field(ge=0, le=1000)
    tags: list[Literal["new", "sale", "eco"]] = Field(max_length=2)


class Answer(BaseModel):
    answer: bool


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: Short | None = None


class Meeting(BaseModel):
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    hour: int = Field(ge=0, le=23)
    people: list[Short] = Field(min_length=1, max_length=2)


class Recipe(BaseModel):
    dish: Short
    servings: int = Field(ge=1, le=12)
    vegetarian: bool


class Trip(BaseModel):
    origin: City
    destination: City
    nights: int = Field(ge=1, le=30)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: Short
    age: int | None = Field(None, ge=0, le=40)


class Matrix(BaseModel):
    rows: list[Annotated[list[int], Field(min_length=2, max_length=2)]] = Field(
        min_length=2, max_length=2)


class Team(BaseModel):
    name: Short
    captain: Person
    members: list[Person] = Field(min_length=1, max_length=2)
    color: Color | None = None


class Flight(BaseModel):
    number: Annotated[str, Field(pattern=r"^[A-Z]{2}[0-9]{3}$")]
    gate: int = Field(ge=1, le=99)
    delayed: bool
    status: Literal["boarding", "departed", "scheduled"]


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (City, "Name a big city and its country."),
    (Person, "Describe a person with a name and an age."),
    (Employee, "Describe an employee and their home address."),
    (Shopping, "Write a short shopping list."),
    (Paint, "Which paint color and how many litres for a small room?"),
    (Sentiment, "Classify the sentiment of: 'I love this movie!'"),
    (Book, "Give details of a famous novel."),
    (Line, "Give a line segment from one point to another."),
    (Weather, "What is the weather like in London today?"),
    (TodoList, "List two things to do today."),
    (Product, "Describe a product in a shop."),
    (Answer, "Is the sky blue?"),
    (Rating, "Rate a restaurant you liked."),
    (Meeting, "Schedule a team meeting."),
    (Recipe, "Suggest a recipe for dinner."),
    (Trip, "Plan a trip between two cities."),
    (Pet, "Describe a pet."),
    (Matrix, "Write a 2x2 matrix of small integers."),
    (Team, "Describe a small sports team."),
    (Flight, "Describe a flight departing soon."),
]
