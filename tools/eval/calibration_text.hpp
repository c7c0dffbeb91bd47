// SPDX-License-Identifier: Apache-2.0
// tools/eval/calibration_text.hpp: the built-in calibration text of `kvc-eval calibrate` (UNComp's head grouping,
// spec shared/specs/uncomp.md §2.5) when no --text is given: a few short children's stories written for kvc, in the
// domain of the small shared models (TinyStories). It is not the evaluation text: `kvc-eval run` samples its prompts
// from the model itself (or reads --prompt-file). Real models should be calibrated on their own kind of text (the
// authors use WikiText-2 windows of 4096 tokens): pass --text FILE.
#pragma once

#include <string_view>

namespace kvc::eval {

inline constexpr std::string_view builtin_calibration_text =
    R"KVC(Once upon a time, in a small town near a wide green hill, there lived a girl named Mira. Mira had a red kite with a long yellow tail. Every morning she ran up the hill with her kite and her little brown dog, Pip. The wind was kind on the hill, and the kite flew high above the trees.

One day the wind was very strong. It pulled the kite so hard that the string slipped out of Mira's hands. "Oh no!" said Mira. "My kite is going away!" Pip barked and ran after it. The kite flew over the pond, over the old barn, and into the tall oak tree at the edge of the field.

Mira and Pip walked to the tree. The kite was stuck on a high branch. Mira could not reach it. She felt sad and sat down on the grass. Then she heard a soft voice. "Why are you sad?" It was a small gray squirrel with a bushy tail. Mira told the squirrel about her kite. The squirrel smiled. "I can help you," it said. "I climb this tree every day."

The squirrel ran up the trunk and along the branch. It pushed the kite with its tiny paws, and the kite fell gently into Mira's arms. Mira laughed and hugged her kite. "Thank you, little squirrel!" she said. She gave the squirrel a nut from her pocket. From that day on, Mira, Pip and the squirrel were good friends, and they played on the hill together when the wind was kind.

Tom was a boy who loved to build things. He built towers with blocks, boats with paper, and houses with sticks. One rainy afternoon his mom gave him a big empty box. "What can you make with this?" she asked. Tom looked at the box for a long time. Then he got his crayons, his tape and a pair of safe scissors.

First he cut a round window on one side. Then he drew buttons and lights on the front. He made a seat inside with an old pillow. "It is a spaceship!" Tom said. He climbed in and closed his eyes. He pretended to fly past the moon and the stars. He waved at a friendly green alien who lived on a planet made of cheese.

When his sister Lily came home, she wanted to fly too. At first Tom did not want to share. The spaceship was small, and it was his. But then he saw Lily's face. She looked sad. Tom thought about it and said, "You can be the captain, and I will be the helper." Lily clapped her hands. They sat in the box together and counted down. "Three, two, one, go!" They flew all the way to the cheese planet and back before dinner. Tom learned that a game is more fun when you share it.

In a quiet garden there was a tiny snail named Sam. Sam was slow, and the other animals often laughed at him. The rabbit could hop, the bird could fly, and the frog could jump into the pond with a big splash. Sam could only move a little bit at a time. He wished he could be fast like them.

One hot summer day, the garden was very dry. The flowers were thirsty, and the leaves turned brown. The animals did not know what to do. Sam moved along slowly, and he noticed something the others had missed. Under a big flat stone, the ground was cool and wet. There was a little spring of water hiding there.

Sam told the rabbit, and the rabbit told the bird, and the bird told everyone in the garden. Together they moved the stone, and the water ran out into the flower beds. The flowers lifted their heads, and the leaves turned green again. The animals thanked Sam. "You saw it because you take your time," said the old frog. Sam felt proud. He did not wish to be fast anymore.

Anna had a grandmother who lived by the sea. Every summer Anna visited her, and every summer they walked on the beach in the early morning. They looked for shells, smooth stones and pieces of blue glass. Grandmother kept them all in a big jar on the kitchen shelf.

This summer Anna found something new. It was a bottle with a piece of paper inside. She pulled out the paper and read it slowly. "Hello, my name is Ben. I live on an island far away. If you find this, please write to me." There was an address at the bottom. Anna ran back to the house to show her grandmother.

They sat at the kitchen table and wrote a long letter together. Anna told Ben about the beach, the jar of shells and the seagulls that stole bread from the picnic basket. She drew a picture of the house with its blue door. Grandmother put a stamp on the letter, and they walked to the post office in the village.

Many weeks later, when Anna was back at home, a letter came for her. It was from Ben! He was very happy that someone had found his bottle. He told her about his island, his goat named Clover and the big storm that had knocked down his fence. Anna wrote back the very same day. The two children became pen friends, and they sent each other letters for many years.

Leo the little bear did not like to go to bed. Every night his mother said, "Time to sleep, Leo," and every night Leo said, "Just five more minutes!" He wanted to play with his wooden train and look at his picture books. He was afraid he would miss something fun.

One night his mother had an idea. "Let us go outside and look at the sky," she said. They walked to the top of the hill behind their cave. The sky was dark and full of bright stars. An owl hooted softly in the woods, and the crickets sang their evening song. The moon was round and silver.

"Everyone is getting ready to rest," said his mother. "The birds are in their nests, the flowers have closed, and even the wind is quiet. Tomorrow the sun will come back, and there will be new things to do." Leo yawned a big yawn. He felt warm and calm. His mother carried him home, and he fell asleep before they reached the cave. After that night, Leo did not ask for five more minutes. He knew that morning would bring new adventures.

At the edge of the forest there was a bakery run by a kind old baker named Mr. Hill. Every day he baked bread, buns and little cakes with cherries on top. The children of the village loved to stop by on their way home from school. Mr. Hill always gave each of them a warm roll.

One winter morning Mr. Hill fell on the ice and hurt his arm. The doctor said he must rest for two weeks. Mr. Hill was worried. "Who will bake the bread for the village?" he asked. The children heard the news and had a meeting under the big tree in the square. They decided to help.

With their parents, the children came to the bakery every morning. Mr. Hill sat in his chair and told them what to do. They measured the flour, mixed the dough and shaped the buns. Some buns were too big and some were too small, and one cake was a little burned. But the people of the village bought everything and said it was the best bread they had ever eaten. When Mr. Hill's arm was better, he baked a giant cake for all his helpers, with a cherry for every child.
)KVC";

}  // namespace kvc::eval
