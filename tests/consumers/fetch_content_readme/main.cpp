// SPDX-License-Identifier: MIT
// A user's program: links pulley::pulley and uses a public type.
#include <pulley/pulley.hpp>

#include <iostream>

int main() {
  const pulley::VariableSpec spec{"dense/kernel", {784, 128}, pulley::Initializer::zeros()};
  std::cout << spec.name << " has " << spec.size() << " elements\n";
  return spec.size() == 784U * 128U ? 0 : 1;
}
